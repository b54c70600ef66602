"""Settings: the declarative option tables, the context API, env_config_path and hot reload."""
