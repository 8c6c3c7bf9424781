"""CDC connector: source readers, durable changelog, UpdateRecord sender, recovery driver."""
