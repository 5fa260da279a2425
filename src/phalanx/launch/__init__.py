"""Launchers: local processes (`phalanx run`) and the elastic agent per node (`phalanx agent`)."""
