"""The bottom layer every package may import: errors, the event bus, internal-error policy."""
