# _batch: see _core.pyx
