"""The optimizers: torch's face, the step template, and what each algorithm does in a step."""
