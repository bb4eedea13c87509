from django.urls import path

from apps.replicas import views

urlpatterns = [
    path("workers", views.workers),
    path("workers/<int:worker_id>", views.worker_detail),
    path("add_worker", views.add_worker),
    path("remove_worker", views.remove_worker),
    path("list_workers", views.list_workers),
]
