"""Tests of kvscope.models (a package so its helpers import relatively)."""
