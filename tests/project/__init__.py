"""The project as a whole: the docs run, the import graph, the scripts."""
