"""Lockstep's built-in execution providers (each registered through ``lockstep.providers``)."""
