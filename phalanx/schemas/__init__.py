"""Published JSON Schemas of Phalanx's spec files (data only): ``service.schema.json``, the schema of the service
spec file that ``phalanx apply -f`` reads (``phalanx.client.load_service_spec`` validates against it)."""
