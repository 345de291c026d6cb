"""verl's config layout read into ours: ``keys.yaml`` lists verl's keys and what each means here (mapped, refused
as unsupported, or without effect); ``compat.py`` applies it to command-line overrides and config files."""
