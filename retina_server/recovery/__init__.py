"""Node recovery: checkpoints, start-up (load, cleansing, rewind), replay admission,
the replay sources and MarkReady."""
