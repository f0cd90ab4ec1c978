"""`moepager <command>`: one small module per command."""
