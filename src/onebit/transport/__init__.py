"""Moving gradients between ranks: the bucketer, a step's exchanges, headers and verdicts."""
