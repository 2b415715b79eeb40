"""Irminsul inside other engines. Each subpackage is optional and imports its engine lazily."""
