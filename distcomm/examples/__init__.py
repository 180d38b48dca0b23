"""Runnable example programs; `quickstart` is the README's main job."""
