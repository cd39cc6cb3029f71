"""The flat fp32 buffers an optimizer keeps, and their views per parameter."""
