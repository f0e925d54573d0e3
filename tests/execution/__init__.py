"""Tests of kvscope.execution (a package so its helpers import relatively)."""
