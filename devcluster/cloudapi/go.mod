module github.com/gpudra/gpudra/devcluster/cloudapi

go 1.26.0
