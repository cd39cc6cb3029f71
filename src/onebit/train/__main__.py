"""``python -m onebit.train``: the same as ``onebit train``; what ``torchrun -m`` runs."""

from .cli import train_main

if __name__ == "__main__":
    train_main()
