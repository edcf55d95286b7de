"""`make bench`: training and decoding rows, profiles and operator counts, measured through public seams."""
