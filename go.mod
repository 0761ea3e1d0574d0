module github.com/gpudra/gpudra

go 1.26.8
