"""L8: figures and tables (matplotlib PNGs, Markdown, HTML) written from the lab's results; the
command line (L9) calls it."""
