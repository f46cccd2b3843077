"""The rewrite engine (selection, substitution) and what the tools share:
pattern matching, kernel contractions, quantized storage formats.
"""
