"""Pickles read without running them: the static machine, torch's objects read as data, scan
verdicts, the pickle writer and torch's safe-globals table."""
