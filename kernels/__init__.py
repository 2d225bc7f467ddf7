"""Page gather/scatter kernels (Triton) with torch references and a backend chooser."""
