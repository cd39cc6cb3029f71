"""``onebit train``: a real data-parallel training run, to see 1-bit optimizers converge.

``cli`` parses options and starts workers, ``data`` prepares the text, ``model`` is a small
byte-level GPT or BERT, ``optim`` builds each optimizer, ``loop`` is the worker's training loop
and ``report`` writes tables and plots. Needs the ``train`` extras (tqdm, matplotlib).
"""
