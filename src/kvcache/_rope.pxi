# _rope: see _core.pyx
