"""Paper tables, the memory table and the figures (`melt-eval report`, `melt-eval memory`)."""
