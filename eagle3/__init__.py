"""eagle3: the shared library behind the numbered pipeline scripts (see README.md)."""
