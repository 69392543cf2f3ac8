"""L4: figures and tables (matplotlib PNGs, Markdown) written from lab results."""
