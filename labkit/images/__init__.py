"""The images the lab builds in place of the real ones (standins), the builder that makes an image
of this machine's own programs and trees (build), and the programs inside them (imagebin,
imagesite)."""
