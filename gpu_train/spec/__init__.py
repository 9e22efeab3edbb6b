"""The shared vocabulary: typed models and pure data, standard library and pydantic only."""
