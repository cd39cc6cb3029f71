"""Bridges from training frameworks to onebit's optimizers, one submodule per framework. A
submodule imports its framework only when it is itself imported (``onebit.integrations.deepspeed``
imports none at all), so importing ``onebit`` or this package never requires a framework you do
not use.
"""
