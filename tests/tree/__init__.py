"""Pytrees without a store: structures, templates, leaves a save accepts, round trips of every leaf kind."""
