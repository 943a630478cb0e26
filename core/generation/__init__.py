"""Generation: the decode loop, stop rules and the main job (`core.run`)."""
