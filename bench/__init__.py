"""Benchmarks: shardflow beside Celery on the same RabbitMQ and Redis."""
