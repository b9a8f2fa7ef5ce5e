# _common: see _core.pyx
