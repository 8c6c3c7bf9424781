"""Retina server: lifecycle, UpdateRecord, write buffer, publish, index, visibility, recovery."""
