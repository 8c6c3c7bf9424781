"""A seeded, reproducible fault campaign against a real local Retina cluster (`make chaos`)."""
