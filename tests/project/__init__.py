"""Tests of the project as a whole: the import graph, the public face, docs, examples."""
