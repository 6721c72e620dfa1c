"""SmolLM2-135M-Instruct: a real instruct model shipped as a PyPI package (see target.py)."""
