"""Rendering of kvtool results: rich tables, JSON documents, CSV rows, plots."""
