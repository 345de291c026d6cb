"""verl's config layout read as an alias layer onto our schema: ``keys.py`` lists verl's keys and what each
means here (mapped, refused as unsupported, or without effect), ``compat.py`` applies them to command-line
overrides and verl-style YAML files before composing."""
