"""Replicas of the engine and the router that sends each request where its content already is."""
