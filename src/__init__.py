"""The thin layer under train.py and evaluate.py: plain functions that tests call directly."""
