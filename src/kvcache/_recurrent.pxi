# _recurrent: see _core.pyx
