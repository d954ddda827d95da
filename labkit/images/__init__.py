"""The images the lab builds in place of the real ones (standins) and the programs inside them
(imagebin, imagesite)."""
