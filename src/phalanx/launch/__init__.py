"""Launchers: local processes (`phalanx run`); elastic agents and executors come later."""
