"""Data parallel inside the plan: gradient buckets and their all_reduces."""
from .buckets import DEFAULT_CAP, Bucket, add_buckets, group_buckets, is_bucket
from .comm import BucketComm, CommLink, DataParallel, LocalComm, measure_link, nominal_link

__all__ = ["DEFAULT_CAP", "Bucket", "add_buckets", "group_buckets", "is_bucket", "BucketComm",
           "CommLink", "DataParallel", "LocalComm", "measure_link", "nominal_link"]
