"""The package as a whole: its layering and what importing it costs."""
