"""One thin adapter per transfer engine; each subclasses the SGLang class and calls core."""
