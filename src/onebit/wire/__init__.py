"""Wire formats: what goes on the wire, with its error feedback."""
