# _unified: see _core.pyx
