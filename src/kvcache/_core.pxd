# cython: language_level=3
# The cimport contract of kvcache: cdef classes and their nogil C-level methods.
# Other extensions write `from kvcache._core cimport UnifiedCore`.

# --- unified -----------------------------------------------------------------

# --- batch -------------------------------------------------------------------

# --- recurrent ---------------------------------------------------------------

# --- rope --------------------------------------------------------------------
